"""`python -m mgpu.gemm_fit`, as documented: the GEMM fits live in mgpu.selector.gemm_fit."""

from .selector.gemm_fit import check_profile, fitted_rates, main, markdown, rate, summary, validate

__all__ = ["check_profile", "fitted_rates", "main", "markdown", "rate", "summary", "validate"]

if __name__ == "__main__":
    raise SystemExit(main())
