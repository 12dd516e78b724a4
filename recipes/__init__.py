raise ModuleNotFoundError("recipes/ holds scripts, not a package: run them, e.g. `python recipes/finetune.py --help`.")
