"""What is trained: Medusa heads, EAGLE heads, draft-model builders, and their formats."""
