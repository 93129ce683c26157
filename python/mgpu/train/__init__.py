"""The training layer: process groups (MPI ranks or threads), config, data, model, schedule,
checkpoints, the trainer loop and its observer. Imports only the bottom and monitor/."""
