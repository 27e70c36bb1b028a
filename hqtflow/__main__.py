from hqtflow.environment import quiet_other_ranks

quiet_other_ranks()  # before anything imports tqdm

from hqtflow.cli import app  # noqa: E402

app()
