"""Sample-quality metrics: Frechet distance in classifier features, class accuracy."""
