"""Computer-vision domain: image data (cv.data), Swin classifiers (cv.model) and report plots (cv.plots).

Plain torch / transformers code: no Lightning, Accelerate or DeepSpeed imports.
"""
