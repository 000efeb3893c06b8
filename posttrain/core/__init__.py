"""Low-level helpers with no posttrain imports: device and precision, seeds and threads, atomic
files and the run summary. Every other layer may use them (see tests/house/test_layers.py)."""
