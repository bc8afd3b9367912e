"""Bridges from other libraries' KNN layers to knnconv.

Each bridge is its own module and imports its library only when that module is imported, so
``import knnconv`` never needs them: ``knnconv.integrations.fovi`` needs fovi.
"""
