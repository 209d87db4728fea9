"""The training runtime: parameter-server data parallelism over any transport, and its graph analyzer."""
