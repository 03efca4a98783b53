"""LoongSage algorithms: pure tensor functions, registered by :mod:`loongsage.algos.plugin`."""
