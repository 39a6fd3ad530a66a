"""What the command line runs for users: train, drift, energy, export, eval, calibrate, QAT fine-tuning."""
