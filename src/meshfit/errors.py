"""The one exception type meshfit raises for problems the user can fix."""


class MeshfitError(ValueError):
    """A problem with the user's input: the message says what is wrong and how to fix it.

    The CLI prints it as one line (no traceback) and exits with status 2; `mf.launch`
    re-raises it in the parent process unchanged.
    """
