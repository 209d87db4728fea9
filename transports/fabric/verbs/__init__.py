"""The ``verbs`` fabric: RC queue pairs on an RDMA NIC through rdma-core's pyverbs.

``setup.py`` holds what needs no hardware (device, port and GID choice, queue-pair attributes,
the connection exchange's encoding, lane to queue pair to CQ mapping); ``device.py`` the backend.
"""
