"""The connector base classes a plugin subclasses."""


class KVConnectorMetadata:
    pass


class SupportsHMA:
    def request_finished_all_groups(self):
        return None


class KVConnectorBase:
    def __init__(self, vllm_config):
        self._vllm_config = vllm_config

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        return KVConnectorMetadata()
