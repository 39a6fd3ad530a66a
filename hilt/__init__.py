"""hilt: the command line. Parses arguments, calls the packages, prints."""
