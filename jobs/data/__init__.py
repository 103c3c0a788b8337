"""Data: the built-in data sets, prepared token sets (``hpc data prepare``) and the data protocol."""
