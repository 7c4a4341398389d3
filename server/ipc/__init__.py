"""What Ferry's own processes share to talk: framed messages and tensors in a /dev/shm arena."""
