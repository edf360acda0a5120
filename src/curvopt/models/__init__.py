"""Networks of the four papers: MLPs and autoencoders, a linear head, CNNs, an LSTM and LLaMA."""
