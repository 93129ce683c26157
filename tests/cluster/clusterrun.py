"""Running mgpu across a virtual cluster from a test: mpirun on host 0 with what a remote
rank needs exported, and whether a rank has ended (the fault tests' clock stops there;
their polling is tests/procs.py's wait_for)."""

from pathlib import Path

from conftest import PYTHON, ROOT, mpi_env  # tests/conftest.py

# What mpirun forwards to every rank (a remote host starts from a clean environment).
EXPORT = (
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MGPU_EMULATE_GPU",
    "OMPI_ALLOW_RUN_AS_ROOT",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
)


class ClusterRun:
    """An mgpu command under mpirun across the cluster (mpirun on host 0)."""

    def __init__(self, cluster, np, args, tmp_path, name="job", emulate_gpu=None, per_host=None):
        extra = {"MGPU_EMULATE_GPU": str(emulate_gpu)} if emulate_gpu else {}
        env = mpi_env(**extra)
        if not emulate_gpu:
            env.pop("MGPU_EMULATE_GPU", None)
        cmd = [*cluster.mpirun_args(np, [e for e in EXPORT if e in env], per_host=per_host), PYTHON, *map(str, args)]
        self.cluster = cluster
        self.job = cluster.start(
            cmd, env=env, cwd=ROOT, stdout=str(tmp_path / f"{name}.out"), stderr=str(tmp_path / f"{name}.err")
        )

    def wait(self, timeout):
        rc = self.job.wait(timeout)
        self.job.kill()
        return rc

    @property
    def stdout(self):
        return self.job.stdout

    @property
    def stderr(self):
        return self.job.stderr


def ended(pid: int) -> bool:
    """Whether process pid has exited (gone, or a zombie its parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
