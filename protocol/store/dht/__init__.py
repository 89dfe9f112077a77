"""The hivemind DHT backend: a store of signed objects split into content-addressed pieces."""
