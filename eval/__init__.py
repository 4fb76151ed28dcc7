"""The instrument: the evaluator, the serving sweep, tuning, the lossless check and reports, over
the one decoder of `draftsmith.decoding`."""
