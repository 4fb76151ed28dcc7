"""The shipped recipes (<family>/<method>.yaml) and accelerate configs (accelerate/), as package data.

`draftsmith train <method> --recipe smollm2/medusa` and `draftsmith.train.recipe_files` find them here.
"""
