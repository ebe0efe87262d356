//! bench report (being written)
