"""fedmq: federated learning for edge fleets over MQTT.

This package is the kernel that both sides share: wire protocol, codecs, model zoo,
datasets, config, transport and CLI. It never imports `aggregator` or `edge_agent`;
those two meet only on the wire.
"""

__version__ = "0.1.0"
