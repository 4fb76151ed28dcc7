"""One readable training loop per method, each runnable with `accelerate launch`."""
