"""The default model's recipe: the data pipeline (data.py) and the trainer (train.py)."""
