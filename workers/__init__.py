"""Worker pools, one package per stage."""
