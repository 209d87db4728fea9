"""Ground modules every layer may use: sizes, statistics, memory, TensorFlow's start-up noise (beside
``bench.results``)."""
