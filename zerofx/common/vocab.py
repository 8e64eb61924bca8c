"""The DNA vocabulary: A, C, G, T are tokens 0..3 and N (any other base) is 4. The bundled models
size their embeddings by it and the genome reader tokenizes by it, so it lives below both."""

DNA_VOCAB = ("A", "C", "G", "T", "N")
