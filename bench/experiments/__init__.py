"""The experiments: what is measured (micro, training, convergence, the paper's plan), above the launch layer,
the runtime and the transports; the readers and the commands sit above them."""
