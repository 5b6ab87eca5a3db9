"""One module per parallel form; compose.py runs them as a table (FORMS). Nothing is
imported here: a form's module is imported where a plan uses it (importing this package
must not pull in the chain compose.py imports)."""
