//! Every output format, behind one trait.
