"""The training subpackage: reproduces every shipped weight (pre-training, fine-tuning)."""
