"""Training data: datasets and crop plans, aspect buckets, synthetic shapes, the content-addressed caches of encoder
outputs on disk with their caching loops and batches, and the atomic / untrusted file helpers everything writes with."""
