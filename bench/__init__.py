"""Experiments over the tensor transports: the ``bench`` command, results store, plots, reports."""

#: ``local``: the experiment's work in one process, without communication: the paper's "Local" line. The
#: micro-benchmark hands the tensor from sender to receiver inside one process (the ``local`` transport, two
#: threads); training runs one process without parameter servers (``bench.experiments.training.train_local``). Either
#: way it is what the work costs with nothing to move.
LOCAL = "local"
#: TensorFlow's own parameter-server training over its C++ gRPC runtime (``bench.experiments.tf_grpc``): not a transport
TF_GRPC = "tf_grpc"
