"""Real data read offline: Fashion-MNIST and Shakespeare text."""
