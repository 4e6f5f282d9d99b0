"""The Keras boundary and the declaration every change to Keras is made through.

- :mod:`.keras_modules`: the one module that names Keras' private package: where the installed
  Keras keeps what we patch, what it already does itself, and the Keras releases supported and checked;
- :mod:`.keras_private`: the one module that touches private attributes of Keras objects (a Variable's
  ``_value``, a layer's ``_losses``, the private methods the overrides replace);
- :mod:`.overrides`: the ``Override`` declaration and its order;
- :mod:`.patches`: rebinding a Keras function in every Keras module that imported it by name;
- :mod:`.defects`: whether the running torch or Keras has a defect of the upstream table, which each workaround asks.
"""
