"""A filesystem that forgets, on command, what a real disk may forget when the power goes.

- :mod:`chronomq.ops.drill.powercut.disk`: the model. Operations pass through to a backing directory;
  what has not been fsynced (file data, directory entries) is remembered and :meth:`cut
  <ops.drill.powercut.disk.Disk.cut>` undoes exactly that.
- :mod:`chronomq.ops.drill.powercut.fuse`: the process that serves a disk over FUSE, with a control
  socket (cut, status, sync).
- :mod:`chronomq.ops.drill.powercut.mount`: start, cut and unmount one from a test or the drill's
  ``power-cut`` fault.
"""
