# Sourced by the scripts that launch mpirun: OpenMPI refuses root without these,
# and more ranks than cores need oversubscription.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
