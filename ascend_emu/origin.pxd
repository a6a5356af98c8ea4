cpdef dict origin_of(dict sites, object gen, object kernel)
