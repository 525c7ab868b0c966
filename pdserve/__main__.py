from pdserve.cli import entry

entry()
