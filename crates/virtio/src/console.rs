//! virtio-console
