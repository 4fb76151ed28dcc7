"""What comes from the target: self-distillation data, loss masks, caches, vocab maps, losses."""
