"""`dpkit train` as library code: the run's config and checks, folder, loop, evaluation, metrics and stop."""
