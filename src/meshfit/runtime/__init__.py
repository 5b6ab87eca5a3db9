"""One step's machinery: the runners, the global batch and its shares, the first step's explanations, precision, prediction."""
