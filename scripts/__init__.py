"""Helper scripts: the demo's hyperparameter search."""
