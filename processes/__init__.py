"""Process control, on a low floor that every room may import: signals and stopping in order
(``stopping``, its handlers installed by ``signals``), starting training processes and
following them (``launch``), and who is who among several (``distributed``)."""
