"""What `%gpucap help`, `%gpucap --help` and `%gpucap?` say: the magic's usage line and its description.

Constants only, standard library nothing: the stand-in magic (stub.py), registered at every kernel start,
takes its docstring from here without loading the grammar (command.py), which builds IPython's parser.
"""

USAGE = "%gpucap [CAP | reset | panel | park | resume | help] [--device N] [--cells on|off] [--help]"

DESCRIPTION = """Show or change this kernel's GPU memory cap.

  %gpucap                  table: device, cap, allocated, reserved, peak, device total, who set the cap
  %gpucap 0.3              ask for a new cap on every device of this kernel (also 30%, 12GiB, 12GB)
  %gpucap --device 1 8GiB  ask for a new cap on cuda:1 only
  %gpucap reset            back to the cap the server's policy gives this kernel
  %gpucap panel            a live usage panel (ipywidgets), with a chart of the last minutes
  %gpucap park             when this cell ends, move this kernel's GPU memory to host memory; the next
                           cell brings it back (a few seconds), tensors unchanged
  %gpucap resume           bring a parked kernel back now (rarely needed: the next cell resumes it)
  %gpucap --cells on|off   one line after each cell: its peak and its change in allocated memory
  %gpucap help             this text (also %gpucap --help and %gpucap?)

The server decides: a request is granted, clamped to what the admin allows, or refused.
An argument %gpucap cannot read is a UsageError, as for IPython's own magics: the cell stops there."""

# The magic's docstring, which `%gpucap?` shows.
DOCSTRING = f"{USAGE}\n\n{DESCRIPTION}"
