"""Training of the embedded tiny DSV4: the synthetic corpus (:mod:`dsv4lab.text.corpus`)."""
