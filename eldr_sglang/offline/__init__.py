"""Offline pipeline: streaming signatures, layer selection, balanced K-means, fit and report.

Nothing here reads domain labels to fit; labels are used only by `report` to score.
"""
