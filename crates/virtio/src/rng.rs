//! virtio-rng
