"""The performance model's Python side: the GPU catalog, the GEMM and allreduce fits to
published tables, hardware profiles, the cost sheet, the memory model, recommend, and
what train asks of it (auto bucket and shares). Imports train/ and the bottom."""
