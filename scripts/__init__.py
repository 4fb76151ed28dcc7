"""Command-line glue: the `draftsmith` console script and the benchmark scripts."""
