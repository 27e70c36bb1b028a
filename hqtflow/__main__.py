from hqtflow.cli import app

app()
