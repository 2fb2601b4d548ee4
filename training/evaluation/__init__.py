"""What samples are judged by: validation.py (the grid and the held-out loss during a run), reference.py (what
samples are scored against: verified Inception, cached statistics), metrics.py (FID, KID, precision, recall,
density, coverage, FD-DINOv2, CLIP score and CLIP features), captions.py (the text protocol: sample i of a text run
takes reference row i's caption; each part's scores and real images' beside them), classifier.py (the evaluation
classifier), ratings.py (human votes), tuning.py (sampling settings chosen on held-out images: RUN/tuned.json and
the model it was chosen for), generation.py (what sample i is: its noise seed, condition, controls and shape),
sampling.py (a run's model read back, batches sampled by the method's generate, handed in, and the small-N FID of
validation).

May import: common.py, config/, data/, model/, objectives/, optimisation/ and run/.
"""
